"""`python -m pykern.precompile`: parallel compile into the cache, table/JSON output, failures, warm reruns."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pykern import cache, precompile
from cache_helpers import FakeStderr, private_sources

ROOT = Path(__file__).resolve().parent.parent
PKT = {"pkt_scale", "pkt_mixed", "pkt_fill"}


@pytest.fixture
def env(tmp_path, monkeypatch):
    return private_sources(tmp_path, monkeypatch)


def _run(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pykern.precompile", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env_extra or {})})


def test_help_tells_the_truth():
    out = _run("--help")
    assert out.returncode == 0
    for flag in ("--arch", "--kernels", "--jobs", "--cache-dir", "--out", "--json", "compute_XX", "all", "--host",
                 "PYKERN_COMPILE_THREADS"):
        assert flag in out.stdout
    from pykern import compiler

    # --jobs defaults to the CPUs this process may use, and says so with the number.
    assert f"may use, {compiler.available_cpus()} here" in " ".join(out.stdout.split())


def test_cold_run_in_parallel_then_all_hits(env, tmp_path):
    args = ["--arch", "sm_80", "--arch", "sm_90a,compute_90", "--kernels", "pkt_*", "--jobs", "2", "--json"]
    cold = _run(*args)
    assert cold.returncode == 0, cold.stderr
    d = json.loads(cold.stdout)  # stdout is only the JSON; progress went to stderr
    assert "[6/6]" in cold.stderr
    assert sum(ln.startswith("start  ") for ln in cold.stderr.splitlines()) == 6  # from the worker processes
    assert (d["jobs"], d["hits"], d["compiled"], d["failures"]) == (6, 0, 6, [])
    rows = {(r["kernel"], r["arch"]): r for r in d["results"]}
    assert set(rows) == {(k, a) for k in PKT for a in ("sm_80", "sm_90a", "compute_90")}
    mixed = rows[("pkt_mixed", "sm_80")]
    assert mixed["kind"] == "cubin" and mixed["status"] == "compiled"
    assert mixed["shared_bytes"] == 256 and mixed["barriers"] == 1 and mixed["registers"] > 0
    assert mixed["spill_stores"] == mixed["spill_loads"] == 0
    ptx = rows[("pkt_fill", "compute_90")]
    assert ptx["kind"] == "ptx" and "registers" not in ptx  # unknown for PTX, not invented
    assert len(list(cache.iter_entries(tmp_path / "cache"))) == 6

    warm = _run(*args)
    assert warm.returncode == 0, warm.stderr
    w = json.loads(warm.stdout)
    assert (w["hits"], w["compiled"]) == (6, 0)
    assert all(r["status"] == "hit" for r in w["results"])
    assert {(r["kernel"], r["arch"], r.get("registers")) for r in w["results"]} == {
        (r["kernel"], r["arch"], r.get("registers")) for r in d["results"]}


def test_table_on_stdout(env, capsys):
    assert precompile.main(["--arch", "sm_86", "--kernels", "pkt_fill", "--jobs", "1"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].split() == ["kernel", "arch", "regs", "spill", "st/ld", "smem", "stack", "status", "time"]
    row = next(ln for ln in lines if ln.startswith("pkt_fill"))
    assert row.split()[1] == "sm_86" and row.split()[3] == "0/0" and "compiled" in row
    assert "pkt_scale" not in out  # filtered out by --kernels
    assert "[1/1] sm_86" in err and "pkt_other.cu" in err
    # A line as each compile starts (a source can take a minute), before the line that says it finished.
    start = next(i for i, ln in enumerate(err.splitlines()) if ln.startswith("start  sm_86"))
    assert "pkt_other.cu" in err.splitlines()[start] and "compiling (1 of 1 to compile)" in err.splitlines()[start]
    assert start < next(i for i, ln in enumerate(err.splitlines()) if ln.startswith("[1/1] sm_86"))
    assert precompile.main(["--arch", "sm_86", "--kernels", "pkt_fill", "--jobs", "1"]) == 0
    assert "hit" in next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("pkt_fill"))


def test_cache_dir_option(env, tmp_path, capsys):
    target = tmp_path / "explicit"
    assert precompile.main(["--arch", "sm_80", "--kernels", "pkt_fill", "--jobs", "1", "--cache-dir",
                            str(target)]) == 0
    assert len(list(cache.iter_entries(target))) == 1
    assert not (tmp_path / "cache").exists()


def test_failure_exits_nonzero_with_log(env, capsys):
    (env / "pkt_zbroken.cu").write_text(
        'extern "C" __global__ void pkt_zbroken(float* y) {\n  y[0] = not_declared;\n}\n')
    rc = precompile.main(["--arch", "sm_80", "--kernels", "pkt_*", "--jobs", "1"])
    out, err = capsys.readouterr()
    assert rc == 1
    assert "FAILED pkt_zbroken.cu for sm_80" in err
    assert "pkt_zbroken.cu(2)" in err and "not_declared" in err  # NVRTC's log with file(line)
    assert "--gpu-architecture=sm_80" in err  # the options used
    assert "pkt_fill" in out  # the sources that compiled are still reported


def test_bad_arguments_exit_2(env, capsys):
    assert precompile.main(["--arch", "sm_99", "--kernels", "pkt_*"]) == 2
    assert "sm_99" in capsys.readouterr().err
    assert precompile.main(["--arch", "sm_80", "--kernels", "no_such_kernel_*"]) == 2
    assert "no_such_kernel_*" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        precompile.main(["--arch", "sm_80", "--cache-dir", "a", "--out", "b"])
    assert e.value.code == 2


def test_bad_option_or_define_exits_2_before_any_compile(env, tmp_path, capsys):
    # A usage error, not one "FAILED" per source and arch with exit status 1.
    assert precompile.main(["--arch", "sm_80", "--kernels", "pkt_*", "--jobs", "1", "--define", "1bad=2"]) == 2
    err = capsys.readouterr().err
    assert "precompile: defines: expected C identifiers as names, got '1bad'" in err and "FAILED" not in err
    assert precompile.main(["--arch", "sm_80", "--kernels", "pkt_*", "--jobs", "1", "--option=-arch=sm_90"]) == 2
    err = capsys.readouterr().err
    assert "precompile: options: pass the arch as the arch argument" in err and "FAILED" not in err
    assert not (tmp_path / "cache").exists()
    assert precompile.main(["--arch", ",", "--kernels", "pkt_*"]) == 2  # nothing to do is not a success
    assert "--arch: expected at least one arch" in capsys.readouterr().err


def test_unusable_out_folder_is_a_usage_error(env, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    assert precompile.main(["--arch", "sm_80", "--kernels", "pkt_fill", "--jobs", "1", "--out",
                            str(blocker / "bundle")]) == 2
    err = capsys.readouterr().err
    assert f"precompile: --out: cannot create the bundle folder {str(blocker / 'bundle')!r}" in err
    assert not (tmp_path / "cache").exists()  # checked before any compile


# ---- --host: the host backend's C++ builds ------------------------------------------------------------
def _host_library(src: Path) -> Path:
    from pykern import sources
    from pykern.host import build
    from pykern.registry import parse_file

    s = sources.load(src)
    return build.library_path(s.path, s.text, s.digest(), sources.include_dirs(s.path.parent), parse_file(s.path))


def test_host_builds_the_selected_source_then_hits(env, tmp_path, capsys):
    lib = _host_library(env / "pkt_other.cu")  # the only source defining pkt_fill
    assert lib.parent == tmp_path / "cache" / "host" and not lib.exists()
    assert precompile.main(["--host", "--kernels", "pkt_fill", "--jobs", "2"]) == 0
    out, err = capsys.readouterr()
    assert lib.is_file()  # the very library the host backend will load
    assert err.startswith("[1/1] host       pkt_other.cu             built (") and "\r" not in err  # one line per item
    assert out.splitlines()[0].split()[:3] == ["pkt_other.cu", "host", "built"]
    assert "1 host builds (" in out and "0 cache hits, 1 built, 0 failed" in out
    from pykern.backends.host import HostBackend

    assert HostBackend().library(env / "pkt_other.cu").path == lib  # found, not rebuilt

    assert precompile.main(["--host", "--kernels", "pkt_fill", "--json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)["host"]
    assert (doc["sources"], doc["hits"], doc["built"], doc["failed"]) == (1, 1, 0, 0)
    assert doc["results"] == [{"source": str((env / "pkt_other.cu").resolve()), "status": "hit",
                               "seconds": doc["results"][0]["seconds"], "library": str(lib)}]
    assert "[1/1] host       pkt_other.cu             hit (" in err


def test_host_progress_bar_on_a_terminal(env, tmp_path, monkeypatch, capsys):
    tty = FakeStderr()
    monkeypatch.setattr(sys, "stderr", tty)
    assert precompile.main(["--host", "--kernels", "pkt_*", "--jobs", "1"]) == 0
    text = tty.text
    assert "\r\033[Khost [........................] 0/2 " in text and "building pkt_" in text
    assert "\r\033[Khost [############............] 1/2 " in text
    assert "\r\033[Khost [########################] 2/2 " in text
    assert text.endswith("\r\033[K")  # the bar is cleared; the table follows on stdout
    assert "[1/2]" not in text  # no per-item lines on a terminal
    assert "2 host builds (" in capsys.readouterr().out


def test_host_failure_and_usage(env, tmp_path, capsys):
    (env / "pkt_zbroken.cu").write_text('extern "C" __global__ void pkt_zbroken(float* y) {\n  y[0] = nope;\n}\n')
    assert precompile.main(["--host", "--kernels", "pkt_zbroken", "--jobs", "1"]) == 1
    out, err = capsys.readouterr()
    assert "FAILED pkt_zbroken.cu for the host backend" in err and f"{env / 'pkt_zbroken.cu'}:2" in err
    assert "nope" in err and "0 built, 1 failed" in out
    assert precompile.main(["--kernels", "pkt_fill"]) == 2
    assert "expected --arch ARCH (NVRTC) and/or --host" in capsys.readouterr().err
    assert precompile.main(["--host", "--out", str(tmp_path / "b")]) == 2
    assert "--out, --option and --define apply to the NVRTC compiles" in capsys.readouterr().err
    assert precompile.main(["--host", "--jobs", "0"]) == 2


def test_host_and_arch_together(env, tmp_path, capsys):
    assert precompile.main(["--host", "--arch", "sm_80", "--kernels", "pkt_fill", "--jobs", "1",
                            "--cache-dir", str(tmp_path / "both")]) == 0
    out, err = capsys.readouterr()
    assert "[1/1] host" in err and "[1/1] sm_80" in err
    assert any(ln.startswith("pkt_fill") and "sm_80" in ln for ln in out.splitlines())
    assert list((tmp_path / "both" / "host").glob("pkt_other-*.so"))
    assert len(list(cache.iter_entries(tmp_path / "both"))) == 1
    assert not (tmp_path / "cache").exists()  # --cache-dir holds both kinds


class _InlineWorkers:
    """precompile._Workers without processes: records the ptxas threads each pool was given and compiles
    in this process."""

    made: list = []

    def __init__(self, n: int, threads: int = 1) -> None:
        self.made.append((n, threads))

    def run(self, jobs, on_start=None):
        for i, job in enumerate(jobs):
            if on_start is not None:
                on_start(i)
            yield i, precompile._compile_job(*job)

    def close(self, root) -> None:
        pass


def test_jobs_share_the_cpus_among_their_compiles(env, monkeypatch, capsys):
    from pykern import compiler

    monkeypatch.setattr(compiler, "available_cpus", lambda: 8)
    monkeypatch.setattr(precompile, "_Workers", _InlineWorkers)
    monkeypatch.setattr(_InlineWorkers, "made", [])
    monkeypatch.delenv("PYKERN_COMPILE_THREADS", raising=False)
    base = ["--kernels", "pkt_*", "--json"]
    # 2 sources x 2 archs = 4 compiles, 3 at once: 8 CPUs / 3 = 2 ptxas threads each.
    assert precompile.main([*base, "--arch", "sm_80,sm_86", "--jobs", "3"]) == 0
    # More jobs than compiles: only 2 workers start, and they get 4 threads each.
    assert precompile.main([*base, "--arch", "sm_89", "--jobs", "16"]) == 0
    assert _InlineWorkers.made == [(3, 2), (2, 4)]
    capsys.readouterr()


def test_a_worker_compiles_with_its_share_of_threads(monkeypatch):
    import queue
    import signal

    from pykern import compiler

    seen = []
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # the worker ignores SIGINT; pytest keeps its own
    monkeypatch.setattr(precompile, "_compile_job",
                        lambda *job: seen.append(compiler.compile_threads()) or (None, "", 0.0))
    monkeypatch.setenv("PYKERN_COMPILE_THREADS", "1")  # restored after the test: _worker sets it
    tasks, results = queue.Queue(), queue.Queue()
    for item in ((0, ("a.cu", "sm_80", (), None, "/nonexistent")), None):
        tasks.put(item)
    precompile._worker(tasks, results, 3)
    assert seen == [3] and os.environ["PYKERN_COMPILE_THREADS"] == "3"


def test_bad_compile_threads_is_a_usage_error(env, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYKERN_COMPILE_THREADS", "lots")
    assert precompile.main(["--arch", "sm_80", "--kernels", "pkt_*", "--jobs", "1"]) == 2
    err = capsys.readouterr().err
    assert "precompile: PYKERN_COMPILE_THREADS: expected an integer" in err and "'lots'" in err
    assert not (tmp_path / "cache").exists()
